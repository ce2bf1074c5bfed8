"""Assets: model loading and specs, tiny test models, offline data (fetching, readers, task converters), paths.

Imports core and cli at most; never tasks, pipeline or bench."""
