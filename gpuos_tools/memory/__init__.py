"""GPU memory the toolkit manages for a program: the owned allocator (stable virtual addresses
through the VMM API), managed memory, pinned staging, and the residency engine that moves owned
memory between HBM and host."""
