"""Built-in models and datasets, and the light registry the service validates specs with."""
