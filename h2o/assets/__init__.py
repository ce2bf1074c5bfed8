"""Assets: model loading and specs, tiny test models, offline data (fetching, readers, task converters), paths,
records as strict JSON.

Imports core and cli at most; never tasks, pipeline or bench."""
