"""Raw text made into the loader's Arrow shards, offline (`fms-prepare-data`: build.py) or before a run's
first step (--cache_dir: cache_dir.py): the input cut into pieces (pieces.py), each tokenized into shards and
marked done (shard_writer.py), on this machine's processes or a Ray cluster (engines.py). The loader
imports none of it unless a run asks for --cache_dir."""
