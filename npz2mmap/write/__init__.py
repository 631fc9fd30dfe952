"""The write side: the plan from the inputs' headers, the blob and its index written, the
conversion, the public ``Writer``, publishing atomically, and merging parts."""
