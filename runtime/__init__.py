"""mcompile.runtime"""
