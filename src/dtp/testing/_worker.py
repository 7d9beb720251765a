"""``python -m dtp.testing._worker``: one rank of a :mod:`dtp.testing` pool."""

from dtp.testing import _worker_main

if __name__ == "__main__":
    _worker_main()
