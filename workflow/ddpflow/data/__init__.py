"""Data: built-in sources (sources), the user's own data (image_folder, npz, plugin_data,
with image_size shared), the staged format every run reads (staging writes it, staged reads
it), and feeding it to the ranks (feed)."""
