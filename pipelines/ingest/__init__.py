"""Images -> index -> partitions -> decoded (x, y) batches, in data-flow order.

* :mod:`.index`: :class:`DataConfig`, the frozen :class:`DatasetIndex`, fixed :class:`Partition` slices and rank shares.
* :mod:`.scan`: lists a dataset on the driver (ImageFolder, flat dir + labels CSV, Parquet; local or S3).
* :mod:`.decode`: reads the encoded bytes and decodes them with the eval transform (PIL + numpy, no torch).
* :mod:`.batches`: Ray Data datasets of decode tasks, the row-preserving Ray Train split, valid batches and skip reports.
* :mod:`.parquet`: offline conversion of an index to Parquet shards and the metadata ``scan`` reads back.
* :mod:`.models`: the model registry and loader (torchvision classifiers, the demo net, user factories).
* :mod:`.demo_data`: offline demo data (digits, letters as an OOD set) and the small demo CNN.
"""
