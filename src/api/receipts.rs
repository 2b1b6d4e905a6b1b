//! `atmost.v1.Receipts`: the public keys that verify signed receipts. Open
//! to every caller (a tool provider checks receipts without a key).

use super::Ctx;
use crate::pb::{self, receipts_server::Receipts};
use tonic::{Request, Response, Status};

pub struct ReceiptsService {
    ctx: Ctx,
}

impl ReceiptsService {
    pub fn new(ctx: Ctx) -> Self {
        Self { ctx }
    }
}

#[tonic::async_trait]
impl Receipts for ReceiptsService {
    async fn get_signing_keys(
        &self,
        _request: Request<pb::GetSigningKeysRequest>,
    ) -> Result<Response<pb::GetSigningKeysResponse>, Status> {
        let keys = self
            .ctx
            .receipts
            .as_ref()
            .map(|signer| signer.current())
            .iter()
            .flat_map(|k| k.public_keys())
            .map(|(key_id, key, current)| pb::SigningKey {
                key_id: key_id.to_owned(),
                algorithm: "ed25519".into(),
                public_key: key.as_bytes().to_vec(),
                current,
            })
            .collect();
        Ok(Response::new(pb::GetSigningKeysResponse { keys }))
    }
}
