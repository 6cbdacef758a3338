"""Pure decisions: devices, placement, partitions, schedules. No Ray, no training code."""
