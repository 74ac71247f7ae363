"""Checkpoint and restore of GPU processes.

- ``procs``: what /proc says about a process (owner, command line, start time, libcuda mapped).
- ``driver``: the driver path — lock, checkpoint, restore, unlock of any CUDA process through
  the NVIDIA driver checkpoint API (cuda-python), with every error path leaving the process
  running or in a documented, restorable state.
- ``registry``: what gpu-ckpt remembers about the processes it checkpointed (their GPUs, bytes).
- ``criu``: full-process images through CRIU >= 4 (``criu dump`` / ``criu restore``).
- ``ports``: the listening TCP sockets a CRIU image records, and the restore's wait for their ports.
- ``profile``: TOML profiles that select processes for a maintenance run, and their state files.
- ``records``: the stream records these write.
- ``image``: the image format of the agent path (a directory: manifest and checksummed chunks,
  incremental chains), with verify, diff and compaction.
- ``periodic``: periodic checkpoints from cron (full vs incremental, names, retention), with the
  agent's snapshot function injected.
"""
