"""The manual pages' text beyond each command's --help, one module per command (named as the
command's module is), each with ``SECTIONS``: titles to bodies in the markup of
gpuos_tools.commands.manpage. The registry (gpuos_tools.commands.registry) says which module
belongs to which command."""
