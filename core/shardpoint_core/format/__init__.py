"""The format, pure: errors, keys, dtypes, values, the state tree, coverage, the manifest
codec and the array layout. No I/O; every rung above builds on it."""
