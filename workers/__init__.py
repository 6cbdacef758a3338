"""Execution: Ray actors that hold blocks on devices and train them. Never imports service/."""
