"""The MetaServer: which node holds which block (store), served over gRPC (service, put together by server);
`kvseal metaserver`."""
