"""The checkpoint files themselves, and their safety (private).

- :mod:`.safetensors_io`: safetensors files in the Hugging Face layout: the lazy reader (an engine
  source over file slices), dtype codes, shard names and sizes.
- :mod:`.safetensors_writer`: the streaming, atomic writer of that layout.
- :mod:`.paths`: index entries must be plain file names; only regular files are opened; a
  converter's destination may not overlap its source.
- :mod:`.lock`: one writer per target (a lock file naming its holder; stale locks taken over).
- :mod:`.commit`: crash-safe commit steps (journal, atomic renames, recovery of leftovers).
- :mod:`.safe_pickle`: DCP metadata read through an unpickler that builds only metadata types.

The scheme is described for users in ``docs/failure_model.md``.
"""
