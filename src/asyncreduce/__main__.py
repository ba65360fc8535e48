"""``python -m asyncreduce``: the same command line as the ``asyncreduce`` script."""

from asyncreduce.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
