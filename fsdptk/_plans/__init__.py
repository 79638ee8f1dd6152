"""Plans made without moving tensors: the sharding plan (``sharding``), the optimizer state layout
(``optim_layout``), buffer planning (``buffers``), Hugging Face TP styles and plan translation
(``hf_tp_styles``, ``hf_tp``)."""
