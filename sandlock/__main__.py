"""``python -m sandlock`` and the ``sandlock`` console script."""

from .cli.run import main

if __name__ == "__main__":
    main()
