"""fsdptk's benchmark suite: fsdptk beside its peers, same input, same run, fresh processes.

Run ``python -m benchmarks --help``; results and how to read them are in docs/benchmarks.md.

Modules: :mod:`benchmarks.model` (the Llama-style model of configurable size), :mod:`benchmarks.methods`
(the registry of scenarios x methods: fsdptk, PyTorch DCP, torchtune, accelerate), implemented in
:mod:`benchmarks.model_state` and :mod:`benchmarks.optim_state` over :mod:`benchmarks.common`;
:mod:`benchmarks.measure` (RSS and bytes from the OS), :mod:`benchmarks.worker` (one rank of one run), :mod:`benchmarks.runner` (launching fresh process groups), :mod:`benchmarks.limits`
(loopback and memory/file bandwidths), :mod:`benchmarks.report` (tables, plots, the results page).
Subcommands with their own modules: ``wire``, ``hosts``, ``async-save``, ``adapter-save`` and ``hf``
(:mod:`benchmarks.hf_peer`: transformers' distributed ``from_pretrained`` / ``save_pretrained`` beside
fsdptk's, over model size and ranks; one rank in :mod:`benchmarks.hf_worker`, the docs section and
plots in :mod:`benchmarks.hf_report`), ``weight-sync`` (:mod:`benchmarks.weight_sync`: ``fsdptk.hf.weight_source``
with one owner and many beside vLLM's ``ModuleSource``, gather-everything-then-send and a raw point-to-point
transfer of the same bytes; ``weight-sync --delta``: :mod:`benchmarks.weight_sync_delta`, ``iter_patches`` after an AdamW step beside a full pass, the raw transfer of the patch bytes and the comparison's own cost), ``quant-save`` (:mod:`benchmarks.quant_save`: an FP8 save beside the
unquantized save of the same model and safetensors' own ``save_file`` of the same bytes).
"""
