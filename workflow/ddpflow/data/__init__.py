"""Data: built-in sources, the user's own data (image folders, npz, plug-ins), the staged
format every run reads, and feeding it to the ranks."""
