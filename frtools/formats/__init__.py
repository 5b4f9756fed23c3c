"""Every artifact frtools reads or writes, on disk or on the wire, each with one owner:
the black box (``blackbox``), PyTorch Flight Recorder dumps (``torch_fr``), the dump
manifest and side files (``manifest``), the job-wide store protocol (``store_protocol``),
the rank summary (``summary``), Parquet (``parquet``). Depends on ``frtools.model`` only.
"""
