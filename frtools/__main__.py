from frtools.cli import entry

entry()
