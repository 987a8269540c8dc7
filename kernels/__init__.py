"""mcompile.kernels"""
