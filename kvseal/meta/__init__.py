"""The MetaServer: which node holds which block (store), served over gRPC (server); `kvseal metaserver`."""
