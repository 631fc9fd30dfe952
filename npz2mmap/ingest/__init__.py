"""The inputs: finding them, and reading NPZ members, zip directories, ``.npy`` files and sample
directories with bounds, down to each element's stored bytes."""
