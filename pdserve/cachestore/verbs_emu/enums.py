"""Verbs constants with the values of <infiniband/verbs.h> (what pyverbs.enums re-exports)."""

from __future__ import annotations

# enum ibv_access_flags
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 2
IBV_ACCESS_REMOTE_READ = 4
IBV_ACCESS_REMOTE_ATOMIC = 8
IBV_ACCESS_MW_BIND = 16

# enum ibv_qp_type / ibv_mw_type
IBV_QPT_RC = 2
IBV_QPT_UD = 4
IBV_MW_TYPE_1 = 1
IBV_MW_TYPE_2 = 2

# enum ibv_qp_state
IBV_QPS_RESET = 0
IBV_QPS_INIT = 1
IBV_QPS_RTR = 2
IBV_QPS_RTS = 3
IBV_QPS_ERR = 6

# enum ibv_wr_opcode
IBV_WR_RDMA_WRITE = 0
IBV_WR_RDMA_WRITE_WITH_IMM = 1
IBV_WR_SEND = 2
IBV_WR_LOCAL_INV = 7
IBV_WR_BIND_MW = 8
IBV_WR_SEND_WITH_INV = 9

# enum ibv_mtu
IBV_MTU_256 = 1
IBV_MTU_512 = 2
IBV_MTU_1024 = 3
IBV_MTU_2048 = 4
IBV_MTU_4096 = 5

# enum ibv_gid_type, ibv_port_state and the link layers (IBV_LINK_LAYER_*)
IBV_GID_TYPE_IB = 0
IBV_GID_TYPE_ROCE_V1 = 1
IBV_GID_TYPE_ROCE_V2 = 2
IBV_PORT_ACTIVE = 4
IBV_LINK_LAYER_INFINIBAND = 1
IBV_LINK_LAYER_ETHERNET = 2

# enum ibv_send_flags
IBV_SEND_SIGNALED = 2

# enum ibv_wc_opcode
IBV_WC_RDMA_WRITE = 1
IBV_WC_BIND_MW = 5
IBV_WC_LOCAL_INV = 6
IBV_WC_RECV_RDMA_WITH_IMM = 129

# enum ibv_wc_status
IBV_WC_SUCCESS = 0
IBV_WC_LOC_LEN_ERR = 1
IBV_WC_LOC_QP_OP_ERR = 2
IBV_WC_LOC_PROT_ERR = 4
IBV_WC_WR_FLUSH_ERR = 5
IBV_WC_MW_BIND_ERR = 6
IBV_WC_REM_INV_REQ_ERR = 9
IBV_WC_REM_ACCESS_ERR = 10
IBV_WC_RETRY_EXC_ERR = 12
IBV_WC_RNR_RETRY_EXC_ERR = 13
