"""Sans-I/O codecs: bytes in, messages out, and back; the servers and clients that move the bytes live above. The
local lane between workers and their engine (`lane.py`) and the peer protocol between engines (`peer.py`)."""
