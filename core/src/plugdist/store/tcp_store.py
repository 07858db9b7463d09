"""(being written)"""
class TCPStore: pass
