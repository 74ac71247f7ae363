"""The injection layer: what wires the in-process side of the toolkit into an unmodified program.

Its native per-operation core (csrc/) sees every driver operation of the program in the program's
own thread and decides, in C, whether anything must happen; Python is entered only when it must.
"""
