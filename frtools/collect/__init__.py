"""Collecting a job's flight records: on one host (``local``), through the job's TCPStore
(``jobwide``), or from PyTorch's own Flight Recorder (``torch_fr``)."""
