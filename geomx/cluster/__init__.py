"""Roles of a geomx deployment: schedulers, local and global servers, and the runtime they share."""
