"""``python -m sandlock`` and the ``sandlock`` console script."""

from .runcli import main

if __name__ == "__main__":
    main()
