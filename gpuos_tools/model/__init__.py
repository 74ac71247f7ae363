"""What the tracer and the tools agree on: allocations, trace record helpers, the wire format
between the in-process tracer and `gpu-trace`, and its decoding into stream records."""
