"""Looking at what was written: ``verify``, what ``inspect`` shows, statistics, ``warm``."""
