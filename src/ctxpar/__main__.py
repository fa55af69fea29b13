"""``python -m ctxpar``: the ``ctxpar`` command where the console script is not on the PATH.
Spawned ranks do not re-run it: multiprocessing skips a package's ``__main__`` module."""
from ctxpar.cli import entry

if __name__ == "__main__":  # imported (pydoc, a tool importing every module), it runs nothing
    entry()
