"""Assets: model loading and specs, tiny test models, offline data (fetching, readers, task converters), paths,
and kvquant's calibration file (``python -m h2o.assets.calibrate``).

Imports core, cli and store's durable files at most; never tasks, pipeline or bench."""
