"""The checkpoint image format: chunked, checksummed, optionally compressed buffer contents with a
sealed manifest, written in parallel and read back, verified, compacted and diffed."""
