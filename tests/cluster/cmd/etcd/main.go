// Command etcd is the etcd server for the local control plane, built from
// go.etcd.io/etcd/server/v3/etcdmain at the version Kubernetes itself pins.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
