"""The SSD tier: persistent, self-describing segments of blocks (format), where they live (device), and the disk
engine that writes, verifies, reclaims and recovers them (tier)."""
