"""Assets: model loading and specs, tiny test models, offline data (fetching, readers, task converters), paths,
kvquant's calibration file (``python -m h2o.assets.calibrate``) and TriAttention's query statistics per model
(``python -m h2o.assets.triattention``).

Imports core, cli and store's durable files at most; never tasks, pipeline or bench."""
