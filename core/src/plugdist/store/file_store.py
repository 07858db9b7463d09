"""(being written)"""
class FileStore: pass
