"""gpu-kinfer-bridge: a LAKE-style inference service reached through shared memory.

Producers (C programs through include/gpuos_kinfer.h, or ``ring.RingClient``) put feature vectors
into a ring; the daemon (``server``) batches them and runs the model on the CPU or the GPU as
the policy (``policy``) decides. ``model`` holds the perceptron and LinnOS's encoding and
training, ``traces`` the block-I/O traces (collected and synthetic), ``replay`` the hedging
simulation, ``features`` LAKE's feature store.
"""
