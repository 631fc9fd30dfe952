"""The read side without torch: a dataset's blobs mapped, one reader over its 1..N parts,
ragged samples located, and whether the data fits in the memory the process may use."""
