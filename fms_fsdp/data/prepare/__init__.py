"""Raw text made into the loader's Arrow shards, offline with `fms-prepare-data` or before a run's first step
with --cache_dir; the loader imports none of it unless a run asks for --cache_dir."""
