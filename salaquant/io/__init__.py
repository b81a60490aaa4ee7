"""Files in and out: checkpoint folders (their files, the reader, the writer, staging and replacement), atomic
writes, the background writer and streamed safetensors."""
