"""``python -m npz2mmap``: the same command line as the ``npz2mmap`` console script."""

from .cli.main import main

if __name__ == "__main__":
    main()
