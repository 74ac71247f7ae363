"""One exit-code enum for the whole toolkit, and the exception that carries one.

Codes 64 and up are the toolkit's own, so that `gpu-trace run` can pass a traced program's
own exit status (usually 0..63 or 128+signal) through unchanged. The `exit` record in the
stream always says which of the two happened.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    BAD_INPUT = 64
    TRUNCATED = 65
    NO_INPUT = 66
    NOT_PYTHON = 67
    PROGRAM_NOT_FOUND = 68
    NO_DRIVER = 69
    NO_CUPTI = 70
    CUDA_ERROR = 71
    NVML_ERROR = 72
    PERMISSION = 73
    IO_ERROR = 74
    SOFTWARE = 75
    NO_SUCH_PROCESS = 76
    NOT_CUDA_PROCESS = 77
    DRIVER_TOO_OLD = 78
    WRONG_STATE = 79
    LOCK_TIMEOUT = 80
    BAD_GPU = 81
    CRIU_UNUSABLE = 82
    CRIU_FAILED = 83
    NOT_CHECKPOINTABLE = 84
    IMAGE_CORRUPT = 90
    SNAPSHOT_UNAVAILABLE = 91
    IMAGE_MISMATCH = 92
    NOT_OWNED = 93
    INTERRUPTED = 130


#: What each code means, for people: man pages (EXIT STATUS) are generated from this.
DESCRIPTIONS: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.FAILURE: "the tool ran but found problems (e.g. a check failed)",
    ExitCode.USAGE: "bad command line (click's own code), or an option this installation cannot honour (--plot without matplotlib)",
    ExitCode.BAD_INPUT: "malformed stream: a bad line or record",
    ExitCode.TRUNCATED: "input ends in the middle of a record or compressed frame",
    ExitCode.NO_INPUT: "input file missing or unreadable",
    ExitCode.NOT_PYTHON: "the program to trace is not a Python program",
    ExitCode.PROGRAM_NOT_FOUND: "the program to run does not exist or is not executable",
    ExitCode.NO_DRIVER: "no NVIDIA driver (libcuda) or no GPU visible",
    ExitCode.NO_CUPTI: "cupti-python or libcupti missing",
    ExitCode.CUDA_ERROR: "a CUDA driver call failed",
    ExitCode.NVML_ERROR: "NVML missing or failed",
    ExitCode.PERMISSION: "not allowed (file or process)",
    ExitCode.IO_ERROR: "writing output failed",
    ExitCode.SOFTWARE: "internal error (a bug in gpuos-tools)",
    ExitCode.NO_SUCH_PROCESS: "no process with that PID (or it exited, or its PID was reused)",
    ExitCode.NOT_CUDA_PROCESS: "the process does not use CUDA (it maps no libcuda, or the driver knows no CUDA state for it)",
    ExitCode.DRIVER_TOO_OLD: "the NVIDIA driver has no checkpoint API (cuCheckpointProcess*) or does not support it here",
    ExitCode.WRONG_STATE: "the process is in the wrong checkpoint state for the action (e.g. already checkpointed, or running when asked to restore)",
    ExitCode.LOCK_TIMEOUT: "the process could not be locked within the timeout; it was left running",
    ExitCode.BAD_GPU: "the GPU to restore onto was not found or is not compatible (other chip, too little free memory, incomplete device map)",
    ExitCode.CRIU_UNUSABLE: "CRIU is needed but missing, older than 4, or failing `criu check`; nothing was touched",
    ExitCode.CRIU_FAILED: "`criu dump` or `criu restore` failed (its log is named in the message)",
    ExitCode.NOT_CHECKPOINTABLE: "the driver could not checkpoint or restore the process (managed memory, IPC, MPS, MIG...)",
    ExitCode.IMAGE_CORRUPT: "a checkpoint image is damaged or incomplete: a chunk missing, extra, truncated or with the wrong checksum, a truncated manifest, or a broken parent chain (the message names the file)",
    ExitCode.SNAPSHOT_UNAVAILABLE: "the agent snapshot path is not available (not connected in this build, or no agent to ask); no image was written",
    ExitCode.IMAGE_MISMATCH: "the image does not fit the process it is to be rolled back into (allocation table, GPU model or driver); nothing was written",
    ExitCode.NOT_OWNED: "the program's device memory is not (all) owned by the agent, so it cannot be suspended through it (start it with GPUOS_AGENT_OWN=1, or suspend what is owned with --partial); the message names the buffers; nothing was changed",
    ExitCode.INTERRUPTED: "interrupted (SIGINT)",
}


class GpuosError(Exception):
    """A fatal, user-facing error: a message for stderr and an exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.FAILURE):
        super().__init__(message)
        self.code = code
