"""Raw text made into the loader's Arrow shards, by `fms-prepare-data` or by a run with --cache_dir (before or
beside its training); the loader imports none of it unless a run asks for --cache_dir."""
