"""DRA mode's pure parts: the driver's names, ResourceSlices, claims and their rules. No I/O."""
