"""The checkpoint image format: chunked, checksummed, optionally compressed buffer contents with a
sealed manifest (`layout`), written in parallel (`writer`, `chunkio`), read back, verified and
diffed (`reader`), and compacted. The names below are what the rest of the toolkit uses."""

from gpuos_tools.image.layout import (
    CHECKSUMS,
    DEFAULT_CHUNK_SIZE,
    IMAGE_DOC,
    ImageError,
    clean_stale_temps,
    fsync_dir,
    remove_image,
    temp_name,
)
from gpuos_tools.image.reader import Image, diff, is_image, open_image, verify
from gpuos_tools.image.writer import ImageWriter, compact

__all__ = ["CHECKSUMS", "DEFAULT_CHUNK_SIZE", "IMAGE_DOC", "Image", "ImageError", "ImageWriter", "clean_stale_temps",
           "compact", "diff", "fsync_dir", "is_image", "open_image", "remove_image", "temp_name", "verify"]
