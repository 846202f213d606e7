"""The built-in dataset formats, one module each (decoder, converter, generator)."""
