"""The ``npz2mmap`` command line: the entry point (``main``), the commands, their text output."""
