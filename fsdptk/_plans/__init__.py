"""Plans made without moving tensors: the sharding plan (``sharding``), the optimizer state layout
(``optim_layout``), buffer planning (``buffers``), Hugging Face TP styles and plan translation
(``tp_styles``: every ParallelStyle fsdptk adds and the one norm rule; ``hf_tp``)."""
