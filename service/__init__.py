"""The domain: specs, persistence, lifecycle, auth, the controller and the CLI."""
