"""The bottom layer: rank agreement (``dist``), canonical FQNs and tie groups (``names``), every
private torch / torchao import (``compat``). Imports no other fsdptk module."""
